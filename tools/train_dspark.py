"""Train the DSpark drafter (dspark/training/cli.py: gather, vocab, train, export)."""
from dspark.training.cli import main

if __name__ == "__main__":
    main()
