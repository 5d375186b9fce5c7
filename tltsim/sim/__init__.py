"""The SimPy model of RL steps: instances, batches, acceptance and drafter dynamics, spot training, metrics, replay and sweeps."""
