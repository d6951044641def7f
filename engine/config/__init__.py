"""The typed settings: allowed values (choices), the train, predict and export schemas, and their registration."""
