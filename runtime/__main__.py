from hotneurons.runtime.cli import main

main()
