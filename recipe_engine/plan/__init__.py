"""Before the weights load: the plan table, memory and disk estimates, and the pre-flight checks."""
