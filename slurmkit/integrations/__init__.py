"""What slurmkit plugs into third-party trainers through their own extension points, so that an
unmodified program reports to the node's agent as a ``slurmkit.userapi`` caller does.

- :mod:`~slurmkit.integrations.lightning`: a Lightning callback, registered with Lightning's
  ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml): every ``Trainer`` built
  in a rank slurmkit started gets it; outside slurmkit it adds nothing.
"""
