"""Training from preference pairs: a reward model (``reinforge rm``) and a policy by DPO (``reinforge dpo``)."""
