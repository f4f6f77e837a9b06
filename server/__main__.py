"""`python -m server ...` is `sleepserve ...`."""
from server.cli import run

run()
