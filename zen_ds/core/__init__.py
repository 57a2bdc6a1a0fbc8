"""Layer 1, core: the row-sparse tensor every scheme passes around (:class:`~zen_ds.core.sparse.RowSparse`),
the communicator that counts every byte, the handshake record, input inspection, the balanced
partition function and a sync's statistics. Imports only :mod:`zen_ds.ops`."""
