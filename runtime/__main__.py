from powerinfer.runtime.cli import main

main()
