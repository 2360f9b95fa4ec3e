from ._gateway import main

main()
