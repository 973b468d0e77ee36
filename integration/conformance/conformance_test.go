// Package conformance runs containerd's own snapshotter test suite
// (github.com/containerd/containerd/snapshots/testsuite) against bootseer-snapshotter,
// talking to it exactly as containerd does: through the proxy snapshotter over gRPC.
// The containerd packages it uses differ between 1.x and 2.x (paths, not calls):
// containerd_1x.go names 1.6's and 1.7's, containerd_2x.go (build tag containerd2) 2.x's.
//
// Each test case gets a fresh daemon whose root and socket live in the case's temp dir.
//
//	BOOTSEER_SNAPSHOTTER  path of the bootseer-snapshotter executable (required
//	                      unless BOOTSEER_BASELINE=overlay)
//	BOOTSEER_BASELINE     "overlay": serve containerd's own overlayfs snapshotter
//	                      in-process through the same gRPC proxy instead, to tell
//	                      a failure of the suite or the proxy from one of the daemon
//	BOOTSEER_LOG_LEVEL    the daemon's --log-level (default "info")
//
// Build offline in GOPATH mode (see integration/test_conformance.py):
//
//	GO111MODULE=off GOPROXY=off GOPATH=<dir>:/usr/share/gocode CGO_ENABLED=0 go test -c [-tags containerd2]
package conformance

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"google.golang.org/grpc"
)

const snapshotterName = "bootseer"

// suiteName is the name the suite is told: it exempts a few kernel limits by snapshotter name,
// and the daemon's mounts are kernel overlayfs mounts as containerd's overlayfs snapshotter's
// are (from 1.7 the Rename case renames a lower layer's directory, which overlayfs without
// redirect_dir refuses with EXDEV, for "overlayfs" only; 1.6's suite skips that case for all).
const suiteName = "overlayfs"

// daemonStartTimeout bounds how long a fresh daemon may take to create its socket.
const daemonStartTimeout = 30 * time.Second

func TestBootseerSnapshotter(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the snapshotter suite mounts overlayfs: needs root")
	}
	switch os.Getenv("BOOTSEER_BASELINE") {
	case "overlay":
		snapshotterSuite(t, suiteName, newProxiedOverlay)
	case "":
		if os.Getenv("BOOTSEER_SNAPSHOTTER") == "" {
			t.Fatal("BOOTSEER_SNAPSHOTTER must name the bootseer-snapshotter executable")
		}
		snapshotterSuite(t, suiteName, newBootseer)
	default:
		t.Fatalf("unknown BOOTSEER_BASELINE %q (only \"overlay\")", os.Getenv("BOOTSEER_BASELINE"))
	}
}

// newBootseer starts a bootseer-snapshotter rooted at root/ (the suite's per-case
// directory) and returns the proxy client for it; close shuts both down.
func newBootseer(ctx context.Context, root string) (snapshotter, func() error, error) {
	base := filepath.Dir(root) // the case's temp dir, removed by the suite
	socket := filepath.Join(base, "bootseer.sock")
	logPath := filepath.Join(base, "bootseer.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, nil, err
	}
	level := os.Getenv("BOOTSEER_LOG_LEVEL")
	if level == "" {
		level = "info"
	}
	cmd := exec.Command(os.Getenv("BOOTSEER_SNAPSHOTTER"),
		"--root", root, "--address", socket, "--log-level", level)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// A daemon that hangs on SIGTERM gets SIGABRT first: faulthandler then writes every
	// thread's Python stack to the log, which the failure report shows.
	cmd.Env = append(os.Environ(), "PYTHONFAULTHANDLER=1")
	// Own process group, so a stuck daemon can be killed with everything it started.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, nil, err
	}
	// exited is closed once the daemon is gone; waitErr is its exit status then.
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()

	kill := func() error {
		defer logFile.Close()
		select {
		case <-exited:
			return fmt.Errorf("daemon had already exited: %v", waitErr)
		default:
		}
		// SIGTERM first (a clean exit is part of the contract), SIGKILL if it lingers.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-exited:
			return waitErr
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(cmd.Process.Pid, syscall.SIGABRT)
			select {
			case <-exited:
			case <-time.After(3 * time.Second):
			}
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
			return fmt.Errorf("daemon ignored SIGTERM for 10s, aborted (stacks in its log): %v", waitErr)
		}
	}
	fail := func(err error) (snapshotter, func() error, error) {
		_ = kill()
		logs, _ := os.ReadFile(logPath)
		return nil, nil, fmt.Errorf("%w\n--- bootseer-snapshotter log ---\n%s", err, logs)
	}

	if err := waitForSocket(socket, exited); err != nil {
		return fail(err)
	}
	conn, err := dial(ctx, socket)
	if err != nil {
		return fail(err)
	}
	sn := newProxy(conn, snapshotterName)
	closeFn := func() error {
		closeErr := sn.Close()
		connErr := conn.Close()
		daemonErr := kill()
		if daemonErr != nil {
			logs, _ := os.ReadFile(logPath)
			return fmt.Errorf("daemon did not exit cleanly on SIGTERM: %v\n--- bootseer-snapshotter log ---\n%s", daemonErr, logs)
		}
		if closeErr != nil {
			return closeErr
		}
		return connErr
	}
	return sn, closeFn, nil
}

// newProxiedOverlay serves containerd's overlayfs snapshotter in-process over a
// unix socket and returns the same proxy client newBootseer does: the baseline
// that tells which failures are the suite's or the proxy's own.
func newProxiedOverlay(ctx context.Context, root string) (snapshotter, func() error, error) {
	backend, err := newOverlay(root)
	if err != nil {
		return nil, nil, err
	}
	socket := filepath.Join(filepath.Dir(root), "overlay.sock")
	listener, err := net.Listen("unix", socket)
	if err != nil {
		backend.Close()
		return nil, nil, err
	}
	server := grpc.NewServer()
	registerService(server, backend)
	go server.Serve(listener)

	conn, err := dial(ctx, socket)
	if err != nil {
		server.Stop()
		backend.Close()
		return nil, nil, err
	}
	sn := newProxy(conn, snapshotterName)
	closeFn := func() error {
		sn.Close()
		conn.Close()
		server.Stop()
		return backend.Close()
	}
	return sn, closeFn, nil
}

// waitForSocket returns once socket accepts connections, or with an error if the
// daemon exits first or does not get there in daemonStartTimeout.
func waitForSocket(socket string, exited <-chan struct{}) error {
	deadline := time.Now().Add(daemonStartTimeout)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return fmt.Errorf("bootseer-snapshotter exited before serving %s", socket)
		default:
		}
		if c, err := net.DialTimeout("unix", socket, time.Second); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("bootseer-snapshotter did not serve %s within %s", socket, daemonStartTimeout)
}

func dial(ctx context.Context, socket string) (*grpc.ClientConn, error) {
	dialCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// grpc-go 1.33 (Debian's) has no credentials/insecure package: WithInsecure it is.
	return grpc.DialContext(dialCtx, "unix://"+socket,
		grpc.WithInsecure(),
		grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		}),
	)
}

// newProxy is containerd's proxy client for the Snapshots service on conn, as containerd makes it.
func newProxy(conn *grpc.ClientConn, name string) snapshotter {
	return newProxySnapshotter(snapshotsapi.NewSnapshotsClient(conn), name)
}

// registerService serves sn as the Snapshots service on server.
func registerService(server *grpc.Server, sn snapshotter) {
	snapshotsapi.RegisterSnapshotsServer(server, fromSnapshotter(sn))
}
