"""Inode numbers for :class:`~bootseer.fuse.nodes.Node` views, and the kernel's references to them.

The kernel names files by inode number and counts its references: every ``lookup``
reply and every entry of a ``readdir`` reply (pyfuse3 answers with readdirplus)
adds one, ``forget`` removes some.  A node is held here while the
kernel references it and dropped when the count reaches zero, so a long-running
mount over a large tree keeps only what the kernel keeps.  Numbers themselves are
never reused: a key keeps its number for the life of the mount, which keeps
``readdir`` and ``stat`` inode numbers consistent and stops the kernel from mixing
the page cache of two different contents.

A node that carries its own number (:attr:`~bootseer.fuse.nodes.Node.inode`) gets
that number and nothing is remembered for it beyond the kernel's references, so a
large immutable tree costs nothing per file it has ever shown, and a restarted
server answers with the numbers of the one before it.
"""

from __future__ import annotations

import errno
from typing import Hashable

import pyfuse3

from bootseer.fuse.nodes import Directory, Node

ROOT_INODE: int = pyfuse3.ROOT_INODE


class InodeTable:
    def __init__(self, root: Directory) -> None:
        self._number_of_key: dict[Hashable, int] = {root.key: ROOT_INODE}
        self._nodes: dict[int, Node] = {ROOT_INODE: root}
        self._references: dict[int, int] = {}
        self._parents: dict[int, int] = {ROOT_INODE: ROOT_INODE}
        self._next_number = ROOT_INODE + 1

    def __len__(self) -> int:
        """Nodes held (the root and every node the kernel references)."""
        return len(self._nodes)

    def number(self, node: Node) -> int:
        """The inode number of ``node`` (its own, or its key's), without taking a reference."""
        if node.inode is not None:
            return node.inode
        number = self._number_of_key.get(node.key)
        if number is None:
            number = self._next_number
            self._next_number += 1
            self._number_of_key[node.key] = number
        return number

    def reference(self, node: Node, parent: int) -> int:
        """Record one kernel reference to ``node`` (a lookup or readdir entry) and return its number.

        The freshest view of a key replaces the one held, so attributes the kernel asks
        for later come from the latest listing.
        """
        number = self.number(node)
        self._nodes[number] = node
        if number != ROOT_INODE:
            self._references[number] = self._references.get(number, 0) + 1
            self._parents[number] = parent
        return number

    def forget(self, number: int, count: int) -> None:
        """Drop ``count`` kernel references; the node goes when none are left."""
        if number == ROOT_INODE:
            return
        left = self._references.get(number, 0) - count
        if left > 0:
            self._references[number] = left
            return
        self._references.pop(number, None)
        self._nodes.pop(number, None)
        self._parents.pop(number, None)

    def node(self, number: int) -> Node:
        try:
            return self._nodes[number]
        except KeyError:
            # The kernel only names inodes it references; anything else is stale.
            raise OSError(errno.ESTALE, f"no inode {number}") from None

    def referenced(self, number: int) -> bool:
        """Whether the kernel holds a reference to inode ``number`` now."""
        return number in self._references

    def parent(self, number: int) -> int:
        """The directory ``number`` was last looked up in (the root for the root)."""
        return self._parents.get(number, ROOT_INODE)
