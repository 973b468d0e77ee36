"""Conversion: an OCI image's layer tars into a store's blocks, indexes and chain records.

:mod:`.tarlayer` reads a layer tar as hostile input; :mod:`.converter` packs its files
into blocks and writes the objects; :mod:`.cli` is ``bootseer convert``.
"""
