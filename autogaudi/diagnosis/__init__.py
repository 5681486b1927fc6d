"""``autogaudi doctor``: find what will make a script slow on Gaudi, on a machine without one.

The doctor runs the user's script for a few training steps on whatever backend exists, observing
only (no optimization unit is applied, no op is changed), stops it cleanly, and turns what it saw
into ranked findings with the script's file:line, the evidence, the Gaudi guide's rule and the fix:
:mod:`~autogaudi.diagnosis.observer` watches, :mod:`~autogaudi.diagnosis.findings` judges by
:mod:`~autogaudi.diagnosis.gaudi_facts`, :mod:`~autogaudi.diagnosis.command` is the command line
and :func:`autogaudi.doctor` the Python entry.
"""
