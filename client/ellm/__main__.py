"""`python -m ellm`: the `ellm` command line."""

from ellm.cli import app

app(prog_name="ellm")
