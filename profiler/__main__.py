"""`python -m hotneurons.profiler` (used under torchrun) is `pi-profile`."""

from hotneurons.profiler.cli import main

main()
