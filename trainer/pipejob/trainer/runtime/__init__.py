"""What every role of every kind needs: its env and rendezvous, performance tuning, the
preflight check, the master's progress endpoint, profiles, checkpoints, the optimizer, and the
master's life (master.py)."""
