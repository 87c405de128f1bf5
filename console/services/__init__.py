"""The Console's services: keyword-only, HTTP-free functions that do what the API and the web view
ask (launch, update, destroy, attach, set a secret, the list queries), checking roles, taking
locks and appending the audit entry in the action's transaction.

They raise `errors.ServiceError`s, which `routes/errors.py` maps to HTTP status codes in one
place; routes and web actions are short adapters over these functions. Nothing here imports
FastAPI, the routes or the web view (tests/test_layering.py).
"""
