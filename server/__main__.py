from hotneurons.server.cli import main

main()
