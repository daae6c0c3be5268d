"""The blueprints, one per resource; the API's path scope is petstore.web.API_PREFIX."""
