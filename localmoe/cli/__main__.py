"""``python -m localmoe.cli`` runs the ``localmoe`` command."""

from localmoe.cli import main

if __name__ == "__main__":
    main()
