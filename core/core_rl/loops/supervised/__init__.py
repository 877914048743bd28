"""The supervised loops' base (SFT, DPO, reward-model training) and the sequences they train on."""
