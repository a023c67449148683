"""The nodelet's cluster DNS: EndpointSlices/Endpoints -> records -> a pod's /etc/hosts."""

from __future__ import annotations

from dtjob.devcluster.nodelet.dns import DnsRecord, records_from_endpoints, records_from_slices, render_hosts


def _slice(ns: str, service: str, endpoints: list[dict[str, object]]) -> dict[str, object]:
    return {
        "metadata": {
            "namespace": ns,
            "name": f"{service}-abcde",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
    }


def test_slices_give_service_names_for_ready_endpoints_and_hostnames_for_all() -> None:
    slices = [
        _slice(
            "team",
            "job",
            [
                {"addresses": ["10.244.1.2"], "hostname": "job-worker-0", "conditions": {"ready": True}},
                {"addresses": ["10.244.2.2"], "hostname": "job-worker-1", "conditions": {"ready": False}},
                {"addresses": ["10.244.3.2"], "conditions": {"ready": True, "terminating": True}},
            ],
        ),
        {**_slice("team", "v6", [{"addresses": ["fd00::1"]}]), "addressType": "IPv6"},
    ]
    assert records_from_slices(slices) == [
        DnsRecord("team", "job", "10.244.1.2"),
        DnsRecord("team", "job-worker-0.job", "10.244.1.2"),
        DnsRecord("team", "job-worker-1.job", "10.244.2.2"),
    ]


def test_endpoints_give_the_same_records() -> None:
    endpoints = {
        "metadata": {"namespace": "team", "name": "job"},
        "subsets": [
            {
                "addresses": [{"ip": "10.244.1.2", "hostname": "job-worker-0"}],
                "notReadyAddresses": [{"ip": "10.244.2.2", "hostname": "job-worker-1"}],
            }
        ],
    }
    assert records_from_endpoints([endpoints]) == [
        DnsRecord("team", "job", "10.244.1.2"),
        DnsRecord("team", "job-worker-0.job", "10.244.1.2"),
        DnsRecord("team", "job-worker-1.job", "10.244.2.2"),
    ]


def test_hosts_file_has_own_names_and_short_forms_only_in_the_same_namespace() -> None:
    records = [DnsRecord("team", "job-worker-1.job", "10.244.2.2"), DnsRecord("other", "db", "10.244.3.2")]
    text = render_hosts("team", "10.244.1.2", "job-worker-0", "job", records)
    lines = text.splitlines()
    assert "127.0.0.1\tlocalhost" in lines
    assert (
        "10.244.1.2\tjob-worker-0.job.team.svc.cluster.local job-worker-0.job.team.svc job-worker-0" in lines
    )
    assert (
        "10.244.2.2\tjob-worker-1.job.team.svc.cluster.local job-worker-1.job.team.svc job-worker-1.job.team "
        "job-worker-1.job"
    ) in lines
    # Another namespace's service: qualified names only, no bare `db`.
    assert "10.244.3.2\tdb.other.svc.cluster.local db.other.svc db.other" in lines


def test_hosts_file_of_a_pod_without_subdomain_names_its_hostname_only() -> None:
    text = render_hosts("default", "10.244.1.9", "solo", None, [])
    assert "10.244.1.9\tsolo" in text.splitlines()
