"""`python -m powerinfer.profiler` (used under torchrun) is `pi-profile`."""

from powerinfer.profiler.cli import main

main()
