//go:build containerd2

// The containerd 2.x packages the suite runs with: the module is .../containerd/v2, the
// snapshot packages are under core/, the overlayfs snapshotter under plugins/.
package conformance

import (
	"google.golang.org/grpc"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
)

type snapshotter = snapshots.Snapshotter

var snapshotterSuite = testsuite.SnapshotterSuite

// newProxy is containerd's proxy client for the Snapshots service on conn, as containerd makes it.
func newProxy(conn *grpc.ClientConn, name string) snapshotter {
	return proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), name)
}

func newOverlay(root string) (snapshotter, error) { return overlay.NewSnapshotter(root) }

// registerService serves sn as the Snapshots service on server.
func registerService(server *grpc.Server, sn snapshotter) {
	snapshotsapi.RegisterSnapshotsServer(server, snapshotservice.FromSnapshotter(sn))
}
