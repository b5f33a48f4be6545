"""Imported once by the fork server of ``forked_python``: loads a config, so that each forked run starts with
OmegaConf's first-use work (the schema's type hints and defaults) done."""

from reinforge.config import load_config

load_config(None, ["model.path=/model"], validate=False)
