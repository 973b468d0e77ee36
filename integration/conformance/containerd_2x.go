//go:build containerd2

// The containerd 2.x packages the suite runs with: the module is .../containerd/v2, the
// snapshot packages are under core/, the overlayfs snapshotter under plugins/.
package conformance

import (
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
)

type snapshotter = snapshots.Snapshotter

var snapshotterSuite, newProxySnapshotter = testsuite.SnapshotterSuite, proxy.NewSnapshotter
var newOverlay, fromSnapshotter = overlay.NewSnapshotter, snapshotservice.FromSnapshotter
