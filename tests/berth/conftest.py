"""The front door's tests use the control plane's fixtures: a real server on loopback with a real SQLite file."""
from tests.controlplane.conftest import api, bootstrap_file, clock  # noqa: F401 (fixtures)
