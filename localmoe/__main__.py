"""``python -m localmoe`` runs the CLI."""

from localmoe.cli import main

if __name__ == "__main__":
    main()
