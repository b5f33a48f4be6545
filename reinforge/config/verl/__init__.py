"""verl's configuration keys (``keys.py``, one table) and the translation of a verl command line (``translate.py``)."""
