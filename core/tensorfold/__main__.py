"""`python -m tensorfold` is the `tensorfold` command."""

from tensorfold.cli import main

main()
