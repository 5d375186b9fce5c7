"""tltsim: a SimPy discrete-event simulator of long-tail RL rollouts (see README.md)."""

__version__ = "0.1.0"
