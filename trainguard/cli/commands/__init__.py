"""One module per top-level command. Each exposes ``register(subparsers)``; main.py discovers them."""
