"""The Console's HTTP routes, one module per resource."""
