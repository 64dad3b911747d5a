"""`python -m dspark.cli ...`: the `dspark` command from a checkout where dspark is not installed."""
from dspark.cli.main import main

main()
