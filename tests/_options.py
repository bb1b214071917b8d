"""Command-line options of the test run that helpers read (set by ``conftest.pytest_configure``)."""

SERVER_DEVICE = "cpu"  # --server-device: where tests/_server.py's live server runs its model
