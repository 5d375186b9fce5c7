"""The ``tltrun`` command line: argument parsing and ``main()``; the only place that prints errors."""
