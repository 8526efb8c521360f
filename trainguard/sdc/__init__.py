"""Silent-data-corruption protection: ``sdc.dmr`` (SpareTrain dual modular redundancy) and ``sdc.abft``
(ATTNChecker algorithm-based fault tolerance for attention). Relies on ``torch``."""
