//go:build !containerd2

// The containerd 1.6 and 1.7 packages the suite runs with (GOPATH paths without /v2).
package conformance

import (
	"google.golang.org/grpc"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/contrib/snapshotservice"
	"github.com/containerd/containerd/snapshots"
	"github.com/containerd/containerd/snapshots/overlay"
	"github.com/containerd/containerd/snapshots/proxy"
	"github.com/containerd/containerd/snapshots/testsuite"
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
