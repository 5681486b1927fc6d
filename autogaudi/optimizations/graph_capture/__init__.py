"""Graph capture of a host-bound training model: the unit's decisions in :mod:`.unit`, the captured
call's mechanisms in :mod:`.captured_call`, the forward's host reads in :mod:`.host_reads`."""
