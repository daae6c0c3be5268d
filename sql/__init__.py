"""The numbered SQL migrations, installed as the package petstore.sql."""
