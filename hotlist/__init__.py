"""First-touch block traces of an image's boot, and the prefetch that replays them on later boots."""
