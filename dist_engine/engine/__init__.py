"""One DP rank's engine: its config (`config.py`), the step loop (`engine.py`), the typed
messages of its inbox (`messages.py`), the model runner (`runner.py`), sampling
(`sampler.py`), what it reports (`outputs.py`) and the errors a group raises (`errors.py`)."""
