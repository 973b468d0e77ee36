//go:build !containerd2

// The containerd 1.6 and 1.7 packages the suite runs with (GOPATH paths without /v2).
package conformance

import (
	"github.com/containerd/containerd/contrib/snapshotservice"
	"github.com/containerd/containerd/snapshots"
	"github.com/containerd/containerd/snapshots/overlay"
	"github.com/containerd/containerd/snapshots/proxy"
	"github.com/containerd/containerd/snapshots/testsuite"
)

type snapshotter = snapshots.Snapshotter

var snapshotterSuite, newProxySnapshotter = testsuite.SnapshotterSuite, proxy.NewSnapshotter
var newOverlay, fromSnapshotter = overlay.NewSnapshotter, snapshotservice.FromSnapshotter
