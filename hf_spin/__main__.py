"""`python -m hf_spin serve ...`: the `hf-spin` command."""

from .cli import main

main()
