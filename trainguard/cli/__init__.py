"""Command-line interface: thin wrappers that parse, call the library and print (or ``--json``)."""
