from cacheroute.sandbox.runtime.cli import main

main()
