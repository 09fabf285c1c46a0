"""The step engine: applies a bound policy to the gradients at the step boundary."""
