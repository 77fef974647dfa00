"""Opacus-shaped utilities (``dpopt.utils.batch_memory_manager`` mirrors ``opacus.utils.batch_memory_manager``)."""
