"""The sp-rtrace text report format, in one place: the protocol's lines,
written, read and post-processed (``text``), record sets converted to
reports (``convert``), and the ``--sp-rtrace`` output (``sink``)."""
