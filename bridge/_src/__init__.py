"""The LMCache bridge's private core: the serde, its options, layouts, transfers, sealing,
the reconnecting RESP adapter and the warm-up. Public names: ``tq_jax.bridge``
(``register``), and the commands ``python -m tq_jax.bridge.launch`` and
``python -m tq_jax.bridge.smoke``; the ``plugin`` adapter loader for LMCache configs."""
