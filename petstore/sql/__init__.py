"""The numbered SQL migrations, the package petstore.sql."""
