"""Jobs built on the engine: a travel run and a training run over a whole local cohort."""
