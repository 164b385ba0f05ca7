"""`splitserve doctor`: the environment checks an operator runs before deploying."""
