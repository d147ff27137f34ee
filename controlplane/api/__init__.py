"""The control plane's HTTP API: the app factory, the error envelope, authentication and the handlers."""
