"""Training a GPT-2 on the travelling GPU: the model, the run directory, the loader and the loop."""
