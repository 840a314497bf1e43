from hotneurons.relufy.cli import main

main()
